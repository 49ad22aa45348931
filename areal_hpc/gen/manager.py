"""The generation manager: who may start a rollout (staleness bound), and which server serves a group.

As the original's manager (REFERENCE.md section 4), in units of rollouts (one prompt's group):
- allocate_rollout grants while running < max_concurrent_rollouts and the rollout would not be too stale:
  expected_version = (accepted + running) // train_bs_n_seqs must not exceed version + max_head_offpolicyness;
- finish_rollout: running - 1, accepted + 1 when the group was kept;
- schedule_request keeps a group on one server (prefix-cache reuse), choosing by round_robin,
  least_requests or least_token_usage.
`accepted` is part of the state to save for recovery: a counter restarted at 0 lets staleness run past eta.
Thread-safe: rollout threads of one process share one manager.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

POLICIES = ("round_robin", "least_requests", "least_token_usage")


@dataclass
class ManagerState:
    """What the manager counts; saved and restored with recover checkpoints."""

    version: int = 0
    accepted: int = 0
    running: int = 0
    dropped: int = 0


class GenerationManager:
    def __init__(
        self,
        n_servers: int,
        train_bs: int,
        max_head_offpolicyness: int,
        max_concurrent: int,
        policy: str = "round_robin",
        total_rollouts: int | None = None,
        state: ManagerState | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.n_servers, self.train_bs, self.eta = n_servers, train_bs, max_head_offpolicyness
        self.max_concurrent, self.policy, self.total_rollouts = max_concurrent, policy, total_rollouts
        self.state = state or ManagerState()
        self._lock = threading.Lock()
        self._next_server = 0
        self._requests = [0] * n_servers  # open groups per server
        self._tokens = [0] * n_servers  # tokens of open groups per server
        self._group_server: dict[str, int] = {}

    # --- staleness control -------------------------------------------------------------------------------

    def expected_version(self) -> int:
        s = self.state
        return (s.accepted + s.running) // self.train_bs

    def counters(self) -> dict[str, int]:
        """What `areal-hpc status` shows: rollouts in flight, accepted and dropped, and how far ahead of the
        servers' weights new rollouts may aim (expected_version <= version + bound)."""
        with self._lock:
            s = self.state
            return {**asdict(s), "expected_version": self.expected_version(), "bound": self.eta,
                    "max_concurrent": self.max_concurrent}  # fmt: skip

    def allocate_rollout(self) -> bool:
        """Grant one more rollout now, or refuse (too many running, too stale, or enough produced)."""
        with self._lock:
            s = self.state
            if s.running >= self.max_concurrent:
                return False
            if self.total_rollouts is not None and s.accepted + s.running >= self.total_rollouts:
                return False
            if self.expected_version() > s.version + self.eta:
                return False
            s.running += 1
            return True

    def finish_rollout(self, accepted: bool) -> None:
        with self._lock:
            self.state.running -= 1
            if accepted:
                self.state.accepted += 1
            else:
                self.state.dropped += 1

    def set_version(self, version: int) -> None:
        """The newest weight version the trainer published (the servers hold it)."""
        with self._lock:
            self.state.version = max(self.state.version, version)

    @property
    def version(self) -> int:
        return self.state.version

    def done(self) -> bool:
        """Every rollout the run needs was produced."""
        with self._lock:
            return self.total_rollouts is not None and self.state.accepted >= self.total_rollouts

    # --- server choice -----------------------------------------------------------------------------------

    def schedule_request(self, group: str, n_tokens: int) -> int:
        """The server of `group`'s requests: the same one for the whole group."""
        with self._lock:
            if group not in self._group_server:
                self._group_server[group] = self._choose()
            server = self._group_server[group]
            self._requests[server] += 1
            self._tokens[server] += n_tokens
            return server

    def release(self, group: str, n_tokens: int) -> None:
        """One of `group`'s requests finished."""
        with self._lock:
            server = self._group_server[group]
            self._requests[server] -= 1
            self._tokens[server] -= n_tokens

    def close_group(self, group: str) -> None:
        """The group is finished: its next requests (if it came back) may go anywhere."""
        with self._lock:
            self._group_server.pop(group, None)

    def _choose(self) -> int:
        if self.policy == "least_requests":
            return min(range(self.n_servers), key=lambda i: (self._requests[i], i))
        if self.policy == "least_token_usage":
            return min(range(self.n_servers), key=lambda i: (self._tokens[i], i))
        server = self._next_server
        self._next_server = (server + 1) % self.n_servers
        return server
