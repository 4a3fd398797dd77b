"""Helpers the test modules share (one definition each; test modules never import each other)."""
