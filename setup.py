"""Maps the import names tgserve.{server,router,kernels} onto the top-level folders of the same name.

Everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup

TOP_LEVEL_FOLDERS = ("server", "router", "kernels")


def mapped_packages() -> tuple[list[str], dict[str, str]]:
    packages = ["tgserve"]
    package_dir = {"tgserve": "tgserve"}
    for folder in TOP_LEVEL_FOLDERS:
        package_dir[f"tgserve.{folder}"] = folder
        packages.append(f"tgserve.{folder}")
        for sub in find_packages(folder, exclude=["tests", "tests.*", "*.tests", "*.tests.*"]):
            packages.append(f"tgserve.{folder}.{sub}")
    return packages, package_dir


packages, package_dir = mapped_packages()
setup(packages=packages, package_dir=package_dir)
