# Stage rules for 'model' (see its issue).
