"""The fault-injection suite's tally, as tests/common/faults.rs has it for the Rust cases.

Each case prints one line, ``fault-injection: CASE: injected I, survived S, served wrong W``,
which ``scripts/fault-injection.sh`` sums into the suite's summary line (pytest ``-s`` shows it).
"""

from dataclasses import dataclass


@dataclass
class Tally:
    """What one fault-injection case did."""

    injected: int = 0
    survived: int = 0
    served_wrong: int = 0

    def fault(self, survived: bool) -> None:
        """One more fault injected, and whether it was survived."""
        self.injected += 1
        self.survived += int(bool(survived))

    def report(self, case: str) -> None:
        """Prints the case's line, then fails unless every fault was survived and nothing was
        served wrong."""
        print(
            f"fault-injection: {case}: injected {self.injected}, survived {self.survived}, "
            f"served wrong {self.served_wrong}",
            flush=True,
        )
        assert self.injected > 0, f"{case}: no fault was injected"
        assert self.survived == self.injected, f"{case}: a fault was not survived"
        assert self.served_wrong == 0, f"{case}: bytes were served wrong as a hit"
