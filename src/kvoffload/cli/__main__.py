"""``python -m kvoffload.cli``."""

from kvoffload.cli import main

main()
