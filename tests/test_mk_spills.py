"""scripts/mk_spills.py's scan: the two spill patterns that wait, found in hand-written SASS."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mk_spills", ROOT / "scripts" / "mk_spills.py")
mk_spills = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mk_spills)

SASS = """
        /*0000*/                   LDG.E.64 R20, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E R22, desc[UR4][R2.64+0x8] ;
        /*0020*/                   STL [R1+0x10], R22 ;
        /*0030*/                   STL [R1+0x14], R21 ;
        /*0040*/                   IADD3 R22, R0, 0x1, RZ ;
        /*0050*/                   STL [R1+0x18], R22 ;
        /*0060*/                   LDG.E.64.STRONG.GPU R24, desc[UR4][R4.64] ;
        /*0070*/                   CCTL.IVALL ;
        /*0080*/                   LDL R30, [R1+0x10] ;
        /*0090*/              @!P0 LDG.E.EF.128 R40, desc[UR4][R6.64] ;
        /*00a0*/              @!P0 STL [R1+0x20], R43 ;
"""


def test_scan_finds_stalled_spill_stores_and_reloads_after_an_acquire():
    ins = [(a, b) for a, b in ((int(m.group(1), 16), m.group(2)) for m in mk_spills.INSTR.finditer(SASS))]
    ins = [(a, mk_spills.re.sub(r"^@!?U?P\w+\s+", "", b)) for a, b in ins]
    found = mk_spills.scan(ins, window=40)
    stalled = [hex(a) for a, _, _ in found["stalled_spill_stores"]]
    # R22 and R21 (the upper half of a 64-bit load) and R43 (a 128-bit load's last register) wait;
    # R22 after the IADD3 no longer holds a load
    assert stalled == ["0x20", "0x30", "0xa0"]
    assert [hex(a) for a, _, _ in found["reloads_after_acquire"]] == ["0x80"]
    assert found["STL"] == 4 and found["LDL"] == 1
    # a window of one instruction keeps only the stores right after their loads
    assert [a for a, _, _ in mk_spills.scan(ins, window=1)["stalled_spill_stores"]] == [0x20, 0xa0]
