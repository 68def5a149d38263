"""The extension declares its classes in ``kvshard`` (``#[pyclass(module = "kvshard")]``) and
the exceptions live in ``kvshard._errors``; each submodule moves its classes' ``__module__`` to
itself, so ``repr``, ``help`` and pickling name the one place the docs name."""


def settle(module: str, names: list[str], namespace: dict[str, object]) -> None:
    """Set ``__module__`` of each class among ``names`` in ``namespace`` to ``module``."""
    for name in names:
        found = namespace[name]
        if isinstance(found, type):
            found.__module__ = module
