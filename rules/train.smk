# Stage rules for 'train' (see its issue).
