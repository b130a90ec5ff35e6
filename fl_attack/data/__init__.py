"""Offline data for clients and benchmarks: images (bundled, on disk, Tiny ImageNet) and UCI Adult.

:mod:`fl_attack.data.images` (the image registry, :func:`~fl_attack.data.images.load_dataset`),
:mod:`fl_attack.data.tabular` (UCI Adult), :mod:`fl_attack.data.locate` (the data-root layout,
the search order, :func:`~fl_attack.data.locate.check_dataset`) and :mod:`fl_attack.data.fetch`
(the ``fl-attack-data`` command that downloads what is not bundled).
"""
