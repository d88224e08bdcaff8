"""The built-in tasks and their data: models, datasets, their files, and the loading of a user's task."""
