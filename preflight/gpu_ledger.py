"""Per-GPU memory ledger of a colocated run, phase by phase: what the trainer, its allocator and the engine hold.

For each phase, on one GPU:

    total = trainer peak + allocator reserve + context + engine share   <=   GPU memory

  trainer peak      tensors the trainer has allocated at the phase's peak, by part (parameters, gradients,
                    optimizer state, gathered FSDP units, activations and temporaries); parts that live in
                    host memory (cpu_offload) are kept apart, for the host ledger (preflight/host_ledger.py);
  allocator reserve memory the caching allocator keeps for the trainer beyond that peak: it holds on to
                    the largest footprint since the last empty_cache(), and no other process (the engine)
                    can use it;
  context           the trainer process's CUDA context, communication buffers and fragmentation;
  engine share      what the rollout engine holds on this GPU in that phase (its memory tags).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9

PARTS = ("params", "grads", "optimizer", "gathered", "activations")
HOST_PARTS_WHEN_OFFLOADED = ("params", "grads", "optimizer")
# PyTorch's memory trackers (torch.distributed._tools.mem_tracker / fsdp2_mem_tracker) name their
# reference types; each maps to one part of the ledger.
_REFERENCES = {
    "params": ("Sharded Param", "Parameter"),
    "grads": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "gathered": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
    "activations": ("Activation", "Temp", "Inputs", "Buffer", "Other"),
}
TRACKER_PARTS = {reference: part for part, references in _REFERENCES.items() for reference in references}


def parts_from_tracker(snapshot: dict) -> dict[str, int]:
    """Ledger parts (bytes) from one device's tracker snapshot {reference type: bytes, "Total": bytes}."""
    parts = dict.fromkeys(PARTS, 0)
    for ref, nbytes in snapshot.items():
        if ref != "Total":
            parts[TRACKER_PARTS.get(ref, "activations")] += int(nbytes)
    return parts


@dataclass
class PhaseRow:
    phase: str
    trainer: dict[str, int]  # bytes on the GPU at the phase's peak, by part
    host_parts: dict[str, int]  # bytes of the phase's peak kept in host memory (cpu_offload), by part
    reserve: int
    context: int
    engine: int
    note: str = ""

    @property
    def trainer_peak(self) -> int:
        return sum(self.trainer.values())

    @property
    def total(self) -> int:
        return self.trainer_peak + self.reserve + self.context + self.engine


@dataclass
class MemoryLedger:
    gpu_bytes: int
    context_bytes: int
    offload: bool = False  # parameters, gradients and optimizer state live in host memory
    rows: list[PhaseRow] = field(default_factory=list)
    reserved: int = 0  # what the trainer's caching allocator holds now

    def record(
        self,
        phase: str,
        parts: dict[str, int],
        engine_bytes: int,
        note: str = "",
        host: dict[str, int] | None = None,
        on_host: tuple[str, ...] = HOST_PARTS_WHEN_OFFLOADED,
    ) -> PhaseRow:
        """Add a phase whose trainer peak has these parts; the allocator's reserve grows to the peak.

        host: bytes by part that live in host memory besides `parts` (all on the GPU); default: with
        offload, the parts named in `on_host` of `parts` (parameters, gradients and optimizer state; an
        offloaded optimizer step also runs its temporaries there)."""
        moved = on_host if self.offload and host is None else ()
        gpu = {k: (0 if k in moved else int(v)) for k, v in parts.items()}
        if host is None:
            host = {k: int(v) for k, v in parts.items() if k in moved and v}
        peak = sum(gpu.values())
        row = PhaseRow(
            phase, gpu, dict(host), max(0, self.reserved - peak), self.context_bytes, int(engine_bytes), note
        )
        self.reserved = max(self.reserved, peak)
        self.rows.append(row)
        return row

    def gpu_bytes_of(self, allocated: dict[str, int]) -> int:
        """The part of a (default-split) allocation that is on the GPU."""
        return sum(v for k, v in allocated.items() if not (self.offload and k in HOST_PARTS_WHEN_OFFLOADED))

    def empty_cache(self, allocated_on_gpu: int) -> None:
        """torch.cuda.empty_cache(): the allocator keeps only what is allocated."""
        self.reserved = allocated_on_gpu

    def first_overflow(self) -> PhaseRow | None:
        return next((row for row in self.rows if row.total > self.gpu_bytes), None)

    def table(self) -> str:
        head = (
            f"{'phase':<26}{'params':>8}{'grads':>8}{'optim':>8}{'gather':>8}{'activ':>8}{'trainer':>9}"
            f"{'reserve':>9}{'context':>9}{'engine':>8}{'total':>8}  of {self.gpu_bytes / GB:.0f} GB"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            cells = "".join(f"{r.trainer[k] / GB:>8.1f}" for k in PARTS)
            flag = "" if r.total <= self.gpu_bytes else f"  SHORT BY {(r.total - self.gpu_bytes) / GB:.1f} GB"
            lines.append(
                f"{r.phase:<26}{cells}{r.trainer_peak / GB:>9.1f}{r.reserve / GB:>9.1f}"
                f"{r.context / GB:>9.1f}{r.engine / GB:>8.1f}{r.total / GB:>8.1f}{flag}"
                + (f"  ({r.note})" if r.note else "")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "gpu_gb": self.gpu_bytes / GB,
            "offload": self.offload,
            "phases": [
                {
                    "phase": r.phase,
                    "total_gb": round(r.total / GB, 3),
                    "trainer_gb": {k: round(v / GB, 3) for k, v in r.trainer.items()},
                    "offloaded_gb": {k: round(v / GB, 3) for k, v in r.host_parts.items()},
                    "reserve_gb": round(r.reserve / GB, 3),
                    "context_gb": round(r.context / GB, 3),
                    "engine_gb": round(r.engine / GB, 3),
                    "note": r.note,
                }
                for r in self.rows
            ],
        }
