"""Drop-in call shapes of other libraries over warpforge's ops (`compat.flash_mla`: FlashMLA's)."""
