"""The device as such: which one and which dtype (`selection`), host-device copies that never make
the host wait (`transfer`), and the one boundary to Habana's bridge (`habana`), imported lazily."""
