"""The kinds of generated tasks and how their items are drawn (no heavy imports: the CLI's parser reads them)."""

from __future__ import annotations

import dataclasses

from hf_pma.utils.parsing import parameter_error

__all__ = ["TASK_KINDS", "TaskOptions"]

TASK_KINDS = ("next_line", "cloze")


@dataclasses.dataclass
class TaskOptions:
    """How items are drawn.

    ``num_items`` per task; ``num_choices`` per item (the true one included);
    ``context_lines`` lines of the document before the line in question; lines usable as
    answers have ``min_line_chars`` to ``max_line_chars`` characters (spaces at the ends not
    counted), which keeps out trivial lines like ``}`` or ``return``.
    """

    num_items: int = 500
    num_choices: int = 4
    context_lines: int = 3
    min_line_chars: int = 16
    max_line_chars: int = 200

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        if self.num_items < 1:
            raise parameter_error("num_items", f"must be at least 1, got {self.num_items}")
        if self.num_choices < 2:
            raise parameter_error("num_choices", f"must be at least 2, got {self.num_choices}")
        if self.context_lines < 1:
            raise parameter_error("context_lines", f"must be at least 1, got {self.context_lines}")
        if not 1 <= self.min_line_chars <= self.max_line_chars:
            raise ValueError(
                f"need 1 <= min_line_chars <= max_line_chars, got {self.min_line_chars} and {self.max_line_chars}"
            )
