"""How one call's requests reach the job's engines, and how what they return comes back to global rank 0.

Every rank of a job makes the same call (`LLM.generate`, the CLI's batch runner) with the same input.
The front end says which of the call's requests this rank's engine is fed (`share`), and gathers one
object (outputs, a run's stats) from each rank that speaks for some of them onto global rank 0
(`collect` at the end of a call; `gather` as a server does after every step). `LLM`, the CLI and the
server ask it and nothing else about the job's layout:

- `ReplicaFront`: one engine, or data-parallel replicas (each a process, or a TP / PP group): each
  replica is fed its token-balanced share and its first rank speaks for it (parallel/data_parallel.py).
- `DisaggregatedFront`: prefill and decode instances: every rank is fed every request (the roles'
  router picks each one's instances), and each decode instance's first rank speaks for what it
  decoded (a prefill instance's too where it serves whole requests: `decode_token_cost`), once global
  rank 0 has heard every decode instance finish (toolkit/disaggregated.py).
"""

from __future__ import annotations

from toolkit.parallel import gather_replicas, my_share


class ReplicaFront:
    # Whether a rank's own outputs tell the call's progress, and whether one input line's several prompts
    # may end on different speakers (they may not here: a replica serves a whole line).
    progress = True
    splits_lines = False

    def __init__(self, state):
        self.state = state  # ParallelState, or None for one process

    def share(self, costs: list[int]) -> list[int]:
        """The indices of the call's requests this rank's engine is fed (`costs`: request_cost each)."""
        return my_share(self.state, costs)

    @property
    def speaks(self) -> bool:
        """Whether this rank's outputs are gathered (its replica's first rank)."""
        return self.state is None or self.state.rank % self.state.replica_size == 0

    def gather(self, obj) -> list | None:
        """`obj` from each speaking rank, in replica order, on global rank 0; None elsewhere. A collective:
        every rank calls it (none without data parallelism, whose one speaker is global rank 0)."""
        return [obj] if self.state is None else gather_replicas(self.state, obj)

    def collect(self, engine, obj) -> list | None:
        """At the end of a call: `gather`."""
        return self.gather(obj)

    def finish(self, engine) -> None:
        """At the end of a call, before a gather of the caller's own (`collect` does both)."""

    def reset_times(self) -> None:
        """Forget the per-request latencies so far (a benchmark's warm-up); replicas keep none."""

    handed_over = 0  # requests whose prompts this rank's instance prefilled for another


class DisaggregatedFront:
    progress = False  # an instance returns only its own requests
    splits_lines = True  # each prompt is routed on its own, and instances write apart

    def __init__(self, role):
        from toolkit.disaggregated import serving_roles

        self.role = role  # this rank's PrefillRole or DecodeRole
        self.roles = serving_roles(role.router.cost)  # whose instances return outputs

    def share(self, costs: list[int]) -> list[int]:
        return list(range(len(costs)))

    @property
    def speaks(self) -> bool:
        """Whether this rank's outputs are gathered (the first rank of an instance that serves requests)."""
        return self.role.role in self.roles and self.role.disagg.local_rank == 0

    def gather(self, obj) -> list | None:
        """`obj` from the first rank of each instance that serves requests, in the layout's order, on
        global rank 0; None elsewhere. A collective: every rank calls it."""
        from toolkit.disaggregated import gather_served

        return gather_served(self.role.disagg, obj, self.roles)

    def collect(self, engine, obj) -> list | None:
        """At the end of a call: `gather`, once global rank 0 has every decode instance's DONE."""
        self.finish(engine)
        return self.gather(obj)

    def finish(self, engine) -> None:
        """Global rank 0 waits for every decode instance's DONE (the others tell it theirs)."""
        self.role.finish_call(engine)

    def reset_times(self) -> None:
        self.role.reset_times()

    @property
    def handed_over(self) -> int:
        """Requests whose prompts this rank's instance prefilled and handed over (0 on a decode rank)."""
        return self.role.connector.handoff_stats.requests if self.role.role == "prefill" else 0


def build_front(parallel, hooks):
    return DisaggregatedFront(hooks) if getattr(hooks, "disagg", None) is not None else ReplicaFront(parallel)
