"""setuptools glue: cffi's `cffi_modules` and the mapping of the top-level
`configs/` and `plugins/` folders into the installed package, so that they are
found after `pip install .` as well as after an editable install."""
from setuptools import setup

setup(
    packages=[
        "colibri_core",
        "colibri_core.cli",
        "colibri_core.convert",
        "colibri_core.experts",
        "colibri_core.experts.hotplug",
        "colibri_core.experts.hotplug.authoring",
        "colibri_core.format",
        "colibri_core.forward",
        "colibri_core.kernels",
        "colibri_core.model",
        "colibri_core.runtime",
        "colibri_core.server",
        "colibri_core.fleet",
        "colibri_core.configs",
        "colibri_core.builtin_plugins",
    ],
    package_dir={
        "colibri_core": "colibri_core",
        "colibri_core.configs": "configs",
        "colibri_core.builtin_plugins": "plugins",
    },
    package_data={
        "colibri_core": ["kernels/c/*.c", "kernels/c/*.h", "models/*/*", "include/*.h",
                         "server/*.html"],
        "colibri_core.configs": ["*.yaml", "*.json"],
        "colibri_core.builtin_plugins": ["*.py"],
    },
    include_package_data=True,
    cffi_modules=["colibri_core/kernels/build.py:ffibuilder"],
    zip_safe=False,
)
