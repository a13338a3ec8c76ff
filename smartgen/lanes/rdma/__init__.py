"""The RDMA lane on pyverbs: pure planning (plan.py, select.py, handshake.py) around thin verbs calls (verbs.py)."""
