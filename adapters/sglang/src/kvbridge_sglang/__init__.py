"""kvbridge-sglang: SGLang's PD-disaggregation transfer backend ``kvbridge`` on any kvbridge backend.

``pip install kvbridge-sglang``, then start SGLang with ``--disaggregation-transfer-backend kvbridge``
(the ``sglang.srt.plugins`` entry point registers it). The layout and bootstrap modules import no SGLang;
``kvbridge_sglang.conn`` and ``kvbridge_sglang.plugin`` need it.
"""

from kvbridge_sglang.layout import REFUSED, SUPPORTED, UnsupportedStateType

__all__ = ["REFUSED", "SUPPORTED", "UnsupportedStateType"]
