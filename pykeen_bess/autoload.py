"""Target of this package's ``pykeen.datasets`` entry point (the only group PyKEEN reads itself).

PyKEEN loads the entry point while ``pykeen.datasets`` is being imported, i.e. in the middle of
PyKEEN's own import. Importing the plugin's training loop from here would be a circular import, so
this module only asks :mod:`pykeen_bess.registration` to register the plugin as soon as PyKEEN has
finished loading. The entry point names PyKEEN's own :class:`~pykeen.datasets.Nations` (already
registered) so that no extra dataset appears in PyKEEN's dataset resolver.
"""

from pykeen.datasets.nations import Nations

from .registration import register_when_ready

__all__ = [
    "Nations",
]

register_when_ready()
