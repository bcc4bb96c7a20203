"""The wheel's packages, found rather than listed so that a new subpackage ships without an edit: runtime and
moesys_cli with all their subpackages, and conf/ and recipes/ shipped inside moesys_cli (moesys_cli.conf with a
package per config group, moesys_cli.recipes) so that a non-editable install finds them anywhere. pyproject.toml
maps those two folders into moesys_cli and names the data files; its own packages.find cannot add packages whose
folders lie outside the package's, so the list is made here."""

from setuptools import find_namespace_packages, find_packages, setup

setup(packages=[*find_packages(include=["runtime", "runtime.*", "moesys_cli", "moesys_cli.*"]),
                "moesys_cli.conf", *(f"moesys_cli.conf.{group}" for group in find_namespace_packages(where="conf")),
                "moesys_cli.recipes"])
