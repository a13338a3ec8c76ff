"""The long-running roles: the prefill node, the decode node (with its HTTP API), and what joins them."""
