"""stallfree's one import root: ``stallfree.gateway``, ``stallfree.core``, ``stallfree.kernels``, ...

The packages live at the top of the repository, where the design puts them;
the links beside this file give them this one name, in a checkout as in the
installed wheel (which holds them as plain folders under ``stallfree/``), so
nothing with a generic name (``core``, ``kernels``) lands in site-packages.
"""
