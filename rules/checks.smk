# Stage rules for 'checks' (see its issue).
