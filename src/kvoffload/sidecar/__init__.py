"""The kvoffload sidecar daemon: store, index, keyring, server."""
