"""Bundles: kernels compiled ahead of time for every GPU family, in one file, loaded without a compiler.

export.py marks kernels, build.py compiles them, format.py is the file, load.py picks and loads
variants, launch.py and fastpath.py launch them. Importing this package imports neither Triton nor torch.
"""
