"""The kvoffload daemon: protocol v1 on a Unix socket over :mod:`kvoffload.store`."""
