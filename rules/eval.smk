# Stage rules for 'eval' (see its issue).
