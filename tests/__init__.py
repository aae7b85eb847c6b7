"""overlapcfg's tests, in folders that mirror the package's layers, plus ``conformance`` (models nobody here wrote),
``multiprocess`` (whole jobs on several processes), ``package`` (the whole package), ``docs`` (README and the
documentation site), ``support`` (shared helpers) and ``thirdparty`` (third-party fixtures, no overlapcfg). Imported
as ``tests.<folder>.<file>``."""
