# Stage rules for 'report' (see its issue).
