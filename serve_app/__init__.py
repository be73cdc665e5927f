"""The CoSine application: configuration, graph builder, OpenAI-compatible ingress, and the `cosine` CLI."""
