"""Maps the top-level folders onto one import namespace: engine/ -> deepserve.engine, and so on.

Nothing named engine, server, router or kernels lands top-level in site-packages; `deepserve` itself
is a namespace package with no files of its own.
"""

from setuptools import find_packages, setup

ROOTS = ("server", "engine", "kvcache", "router", "disagg", "kernels")

package_dir = {f"deepserve.{root}": root for root in ROOTS}
packages = []
for root in ROOTS:
    packages.append(f"deepserve.{root}")
    packages += [f"deepserve.{root}.{sub}" for sub in find_packages(root)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "deepserve.server": ["py.typed"],
        "deepserve.kernels.cpu": ["csrc/*.cpp", "csrc/*.h"],
    },
)
