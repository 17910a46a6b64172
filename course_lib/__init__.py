"""course_lib: the importable half of the course "Data-parallel training in PyTorch from scratch".

Each module is one concept, small enough to read in one sitting, named after its PyTorch
counterpart where there is one. Import the modules you need::

    from course_lib import devices, data, lenet, bench
    from course_lib.lenet import init_lenet_params, lenet

The names listed in each module's ``__all__`` are the stable API that homework relies on.
"""
__version__ = "0.1.0"
