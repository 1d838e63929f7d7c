"""The truth oracle: a small reference DSA-MLA model (``refmodel``), its row packing in the real
byte layouts (``rowpack``), and the driver that decodes through ulacache and through a fully
resident store and compares them bit for bit (``driver``). Not needed to serve."""
