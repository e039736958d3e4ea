"""The command line and each command's module: bench (an op, a checkpoint), demo, coverage, the version
matrix, verification on a user's checkpoint. Only ``engine.__main__`` imports the CLI."""
