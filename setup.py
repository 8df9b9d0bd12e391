"""Only the package list lives here: every other setting is in pyproject.toml.

The repository root is the import package ``tokenloom`` (``package-dir`` in pyproject.toml),
so its sub-packages are found under the root and named ``tokenloom.<path>``; a list written
out by hand once forgot ``tokenloom.planner`` and the wheel shipped without it.
"""

from setuptools import find_packages, setup

NOT_PACKAGED = ["tests", "tests.*", "examples", "examples.*", "scripts", "scripts.*", "build", "build.*", "docs"]

setup(packages=["tokenloom", *(f"tokenloom.{name}" for name in find_packages(".", exclude=NOT_PACKAGED))])
