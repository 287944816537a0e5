"""Builds torchneuron._C, the small C++ glue PyTorch's PrivateUse1 device needs."""
import glob
import os

import torch

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "torchneuron._C",
            sources=sorted(glob.glob("torchneuron/_csrc/*.cpp")),
            # Kineto's plugin interface (profiler.cpp): its headers ship in torch's include/kineto
            include_dirs=[os.path.join(os.path.dirname(torch.__file__), "include", "kineto")],
            extra_compile_args=["-O2", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
