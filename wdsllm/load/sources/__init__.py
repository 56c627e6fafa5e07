"""Sources: what the loader reads, behind one Protocol (``protocol.Source``).

- ``packed``: a packed dataset (``PackedSource``), resolved from a root, an index URL or shards;
- ``load.raw``: raw text tokenized on the way in (``RawSource``);
- ``mixture``: several sources with quotas (``MixtureSource``), raw text among them (``mixraw``);
- ``lengths``: documents' lengths unit by unit, from lengths.npy, a count sidecar, or both;
- ``open``: ``open_source``, from whatever a face was given.

Only the Protocols are imported here: the modules import the stages they feed, and the stages
import the Protocols, so importing this package never imports a source.
"""

from .protocol import DocumentLengths, Opening, Source, UnitReader

__all__ = ["DocumentLengths", "Opening", "Source", "UnitReader"]
