"""One module per ``tierfs`` command; each exposes ``add_parser(subparsers)`` and ``run(args)``."""
