"""Loss scaling and overflow: the dynamic loss scaler, torch autocast's policy, the overflow
monitor and the report of which gradient overflowed. Imports reduce/ and config only."""
