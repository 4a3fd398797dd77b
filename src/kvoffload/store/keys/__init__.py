"""kvoffload.store.keys."""
