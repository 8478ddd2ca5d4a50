"""Where the model's chunks sit: virtual pipeline stages placed on stage workers.

With `n_chunks` chunks per worker the model is cut into n_actors x n_chunks virtual stages,
each a contiguous run of layers. Worker `a` holds chunk `c` of them:

- "loop" (interleaved 1F1B): virtual stage k sits on worker k % n_actors as its chunk
  k // n_actors, so a micro-batch goes round the workers n_chunks times;
- "v" (ZB-V): the chunks zig-zag, chunk 0 down the workers and chunk 1 back up, so the
  first and last virtual stages share worker 0 and the turn at the last worker hands its
  activation (and later its gradient) over locally, without a send.

One chunk per worker is the plain pipeline: virtual stage k is worker k.
"""
from __future__ import annotations

from dataclasses import dataclass

from raypar.schedule.ir import ScheduleError

PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Layout:
    n_actors: int
    n_chunks: int = 1
    placement: str = "loop"

    def __post_init__(self) -> None:
        for name in ("n_actors", "n_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
        if self.placement not in PLACEMENTS:
            raise ScheduleError(f"unknown chunk placement {self.placement!r}; valid placements: {', '.join(PLACEMENTS)}")

    @property
    def n_virtual(self) -> int:
        return self.n_actors * self.n_chunks

    def place(self, vs: int) -> tuple[int, int]:
        """(worker, chunk) of virtual stage `vs`."""
        if not 0 <= vs < self.n_virtual:
            raise ScheduleError(f"virtual stage {vs} does not exist; this layout has 0..{self.n_virtual - 1}")
        chunk, pos = divmod(vs, self.n_actors)
        if self.placement == "v" and chunk % 2:
            pos = self.n_actors - 1 - pos
        return pos, chunk

    def virtual(self, actor: int, chunk: int) -> int:
        """The virtual stage worker `actor` runs as its chunk `chunk`."""
        if not (0 <= actor < self.n_actors and 0 <= chunk < self.n_chunks):
            raise ScheduleError(f"worker {actor} chunk {chunk} does not exist in a layout of {self.n_actors} "
                                f"worker(s) x {self.n_chunks} chunk(s)")
        pos = self.n_actors - 1 - actor if self.placement == "v" and chunk % 2 else actor
        return chunk * self.n_actors + pos

    def next(self, actor: int, chunk: int) -> tuple[int, int] | None:
        """(worker, chunk) of the virtual stage after this one; None on the last."""
        vs = self.virtual(actor, chunk)
        return self.place(vs + 1) if vs + 1 < self.n_virtual else None

    def prev(self, actor: int, chunk: int) -> tuple[int, int] | None:
        vs = self.virtual(actor, chunk)
        return self.place(vs - 1) if vs > 0 else None

    def is_first(self, actor: int, chunk: int) -> bool:
        """Runs the embedding: its input is the tokens."""
        return self.virtual(actor, chunk) == 0

    def is_last(self, actor: int, chunk: int) -> bool:
        """Runs the head and the loss."""
        return self.virtual(actor, chunk) == self.n_virtual - 1

    def forward_links(self) -> list[tuple[int, int]]:
        """(sender, receiver) worker pairs activations travel between, in virtual-stage order
        (gradients travel each the other way); a local hand-over is no link."""
        links: list[tuple[int, int]] = []
        for vs in range(self.n_virtual - 1):
            pair = (self.place(vs)[0], self.place(vs + 1)[0])
            if pair[0] != pair[1] and pair not in links:
                links.append(pair)
        return links

    def holds_data(self, actor: int) -> bool:
        """Reads the batch: it embeds tokens or computes the loss."""
        return any(self.is_first(actor, c) or self.is_last(actor, c) for c in range(self.n_chunks))


def single(n_actors: int) -> Layout:
    """One chunk per worker: the plain pipeline."""
    return Layout(n_actors)
