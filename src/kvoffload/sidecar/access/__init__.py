"""kvoffload.sidecar.access."""
