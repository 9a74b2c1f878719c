"""Draft-model distillation: `adaspec distill-draft` (teacher.py -> draft.py -> train.py ->
evaluate.py -> card.py, driven by pipeline.py) and `adaspec eval-draft`.

Kept free of heavy imports so the CLI can name the error type without loading torch."""


class DistillError(ValueError):
    """Bad input to distillation or evaluation; the message names the flag and the problem."""
