"""kvoffload.store.shared."""
