"""The bottom layer: formats, parsers and system calls every other layer builds on."""
