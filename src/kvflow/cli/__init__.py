"""Command line: `kvflow --help`."""
