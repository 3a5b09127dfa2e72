"""The package list, derived from the tree (pyproject.toml holds everything else).

actors/, ipc/ and launch/ are top-level folders (they mirror the processes) but install as megatrain.actors,
megatrain.ipc and megatrain.launch, so no generic name like `ipc` lands in site-packages. setuptools' own
discovery cannot rename a folder, so every package under each folder is found here: a new subpackage ships
in the wheel without a second list to keep up to date (tests/test_wheel.py builds and runs one)."""

from setuptools import find_packages, setup

FOLDERS = {"megatrain": "megatrain", "megatrain.actors": "actors", "megatrain.ipc": "ipc", "megatrain.launch": "launch"}


def packages() -> list[str]:
    found = []
    for name, folder in FOLDERS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(packages=packages(), package_dir=FOLDERS)
