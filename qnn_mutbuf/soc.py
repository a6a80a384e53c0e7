"""Chipset names: which SoCs ExecuTorch knows and their HTP architecture."""

from __future__ import annotations

from qnn_mutbuf.errors import LoweringError


def known_socs() -> dict[str, object]:
    from executorch.backends.qualcomm.utils.utils import get_soc_to_chipset_map

    return get_soc_to_chipset_map()


def resolve_soc(name: str):
    """The QcomChipset for a name like "SM8650"; an unknown name lists the valid ones."""
    socs = known_socs()
    key = str(name).strip().upper()
    if key not in socs:
        raise LoweringError(
            f"Unknown SoC {name!r}. ExecuTorch knows: {', '.join(sorted(socs))}. "
            "SM8650 is the Snapdragon 8 Gen 3 (HTP v75)."
        )
    return socs[key]


def htp_arch(name: str) -> int:
    """HTP architecture number of a SoC, e.g. 75 for SM8650."""
    from executorch.backends.qualcomm.utils.utils import get_soc_to_htp_arch_map

    resolve_soc(name)
    return int(get_soc_to_htp_arch_map()[str(name).strip().upper()])
