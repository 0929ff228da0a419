# Stage rules for 'preflight' (see its issue).
