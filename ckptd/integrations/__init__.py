"""Job-side integrations that import a training framework (install ``ckptd[mindspore]``); nothing in
``ckptd`` proper imports these."""
