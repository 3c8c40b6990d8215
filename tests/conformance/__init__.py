"""Conformance suites, importable like zarr's ``testing/``: a new backend, foreign reader or
location gets the whole suite by subclassing one class and filling its hooks.

- :mod:`.backends`: :class:`~conformance.backends.BackendTests` (ckptvar's own containers);
- :mod:`.readers`: :class:`~conformance.readers.ReaderTests` (every foreign reader);
- :mod:`.locations`: :class:`~conformance.locations.LocationTests` (where bytes live).
"""
