"""One pipeline stage's step: the schedule executor (`executor`), its point-to-point posts (`p2p`) and the B/W backward split (`split_backward`)."""
