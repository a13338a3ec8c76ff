"""What one node process runs with (`smartgen serve`'s options as one object), and its checks before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from smartgen.engine.retention import RETENTIONS
from smartgen.lanes.backends import INPROC, lane_problem
from smartgen.roles.colocated import DecodeSettings
from smartgen.roles.kv_events import events_problem
from smartgen.roles.launch import DTYPES, NodeSettings
from smartgen.roles.limits import PrefillLimits

__all__ = ["ROLES", "ServeSettings"]

ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class ServeSettings:
    """A prefill node, a decode node, or both in one process (`role`), and where each listens.

    Each field is the `smartgen serve` option of that name (`--max-queue` is `prefill_limits.max_queue`, `--scheme`
    `decode.scheme`), and `check()` names the option in its one-line error. `role="both"` takes
    `node.lane="inproc"`, needs no secret, and serves the decode half's API on `http` and the prefill half's status
    on `status`.
    """

    role: str
    node: NodeSettings
    listen: str = "127.0.0.1:7100"  # prefill: HOST:PORT decode nodes connect to (port 0: the system picks)
    prefill: str = "127.0.0.1:7100"  # decode: the prefill nodes, HOST:PORT[,HOST:PORT...]
    http: str = "127.0.0.1:8000"  # decode and both: the OpenAI-compatible API
    status: str = ""  # prefill and both: the prefill node's /status and /metrics; "" = off
    fallback_strategy: str = "streaming"  # prefill: the proactive set where no profile matches
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    prefill_limits: PrefillLimits = field(default_factory=PrefillLimits)
    ready_file: Path | None = None  # the bound addresses as JSON, written once the node serves
    record: Path | None = None  # /status appended once a second (JSON lines) for `smartgen monitor --replay`
    insecure: bool = False  # no shared secret: any peer that reaches the port is accepted
    ingress_gbps: float | None = None  # decode: one paced link all prefill nodes' bytes into it cross (lanes/ingress)

    def check(self) -> None:
        """Raises ValueError (one line, naming the option) for settings that cannot run; loads no model."""
        node = self.node
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if node.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
        both = self.role == "both"
        if both != (node.lane == INPROC):
            raise ValueError(
                f"--lane {node.lane} cannot join the nodes of --role both: it runs over the in-process lane "
                "(--lane inproc)"
                if both
                else f"--lane inproc joins a prefill and a decode node in one process: use it with --role both, "
                f"not --role {self.role}"
            )
        if both and node.tls is not None:
            raise ValueError("--tls-cert, --tls-key and --tls-ca secure node-to-node sockets; --role both has none")
        if not node.secret and not self.insecure and not both:  # colocated nodes have no socket between them
            raise ValueError(
                "no shared secret: set $SMARTGEN_SECRET (or --secret) to the same value on both nodes, or pass "
                "--insecure"
            )
        for option, path in (("--record", self.record), ("--ready-file", self.ready_file)):
            if path is not None and not path.parent.is_dir():
                raise ValueError(f"cannot write {option} {path}: folder {path.parent} does not exist")
        if self.ingress_gbps is not None:
            if self.role != "decode":
                raise ValueError(
                    f"--ingress-gbps paces what a decode node receives from its prefill nodes; --role {self.role} "
                    "has none over sockets (pace a node's sends with --link-gbps)"
                )
            if not self.ingress_gbps > 0 or self.ingress_gbps == float("inf"):
                raise ValueError(f"--ingress-gbps must be a positive rate, got {self.ingress_gbps}")
            if node.lane != "tcp":
                raise ValueError(
                    f"--ingress-gbps paces what the tcp lane's sockets read; --lane {node.lane} moves KV outside them"
                )
        if problem := lane_problem(node.lane):
            raise ValueError(problem)
        if node.prefix_retention not in RETENTIONS:
            raise ValueError(
                f"--prefix-retention must be one of {', '.join(RETENTIONS)}, got {node.prefix_retention!r}"
            )
        if node.kv_events is not None and (problem := events_problem(node.kv_events)):
            raise ValueError(problem)
        if node.tls is not None and self.role == "prefill":  # loaded now: a bad file fails before the model loads
            node.tls.server_context()
        elif node.tls is not None:
            node.tls.client_context()
