"""Conformance on models nobody here wrote (fixtures in ``tests/thirdparty``, which import no overlapcfg)."""
