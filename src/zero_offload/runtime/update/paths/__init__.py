"""One update path per placement: the device update, the host update (and its worker thread),
the NVMe update, the partial split between device and host (twin), a client optimizer."""
