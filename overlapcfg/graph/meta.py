"""Where overlapcfg stores its data on fx objects: one namespace, written once at creation, read everywhere else.

- ``node.meta[META_KEY]["owner"]``: the ``CollectiveOwner`` of a traced FSDP collective (``overlapcfg.demo.tracing``);
- ``node.meta[META_KEY]`` ``{"bucket", "kind", "direction", "role", "sources"}`` on merged collectives
  (``overlapcfg.graph.merge``);
- ``gm.meta[META_KEY]``: the ``PassRecord`` of the last ``apply`` (``overlapcfg.graph.record``).
"""

META_KEY = "overlapcfg"
OWNER_KEY = "owner"

__all__ = ["META_KEY", "OWNER_KEY"]
