"""Builds torchneuron._C, the small C++ glue PyTorch's PrivateUse1 device needs."""
import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "torchneuron._C",
            sources=sorted(glob.glob("torchneuron/_csrc/*.cpp")),
            extra_compile_args=["-O2", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
